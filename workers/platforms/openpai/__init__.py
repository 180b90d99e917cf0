"""The `openpai` platform: a job per trial on an OpenPAI cluster, output on its shared storage."""
