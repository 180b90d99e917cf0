"""Archiving finished experiments: their log and views leave Redis for a directory or an S3 bucket.

`moves` moves an experiment out (archive) and back (restore), and serves reads of an archived one from a
copy that expires (thaw); `segments` is the archive's format; `stores` where it is kept; `policy` archives
experiments some hours after they end.
"""
