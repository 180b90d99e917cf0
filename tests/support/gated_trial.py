"""A trial script the platform tests share, written into the code directory as trial.py: it reports
metric `i` for each i in `before`, writes its pid to the file `started` (if given), waits for the file `gate`
(if given), reports each of `after`, then exits with `code` (writing "the last words" to stderr when
that is not 0). Every metric is a line of stdout, NNI's wire format off the local platform; the final
one says where its output and its GPUs were."""

GATED_TRIAL = r"""
import json, os, sys, time
form = json.load(open(os.path.join(os.environ["NNI_SYS_DIR"], "parameter.cfg")))
p = form["parameters"]

def report(kind, sequence, value):
    record = json.dumps({"parameter_id": form["parameter_id"], "type": kind, "sequence": sequence,
                         "value": json.dumps(value)})
    print("NNISDK_MEb'" + record + "'", flush=True)  # as NNI's SDK prints it

for i in p.get("before", []):
    report("PERIODICAL", i, i)
if p.get("started"):
    with open(p["started"], "w") as started:
        started.write(str(os.getpid()))
deadline = time.time() + 300
while p.get("gate") and not os.path.exists(p["gate"]) and time.time() < deadline:
    time.sleep(0.02)
for i in p.get("after", []):
    report("PERIODICAL", i, i)
cuda = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
report("FINAL", 0, {"default": 1.0, "output": os.environ["NNI_OUTPUT_DIR"], "cuda": cuda})
if p.get("code"):
    sys.stderr.write("the last words\n")
sys.exit(p.get("code", 0))
"""
