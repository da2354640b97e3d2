"""A stand-in extraction job for the GPU-pinning tests (run as a real subprocess).

    python tests/_gpu_child.py N JOURNAL BUSY_DIR HOLD_S [NAME]

Claims N devices with eagledata.extract.gpus (before importing anything heavy, as the real job does),
then, while holding them, marks each device busy with an O_EXCL file in BUSY_DIR (a second holder
of the same device fails to create it: recorded as a violation), counts the busy files (more than
EAGLEDATA_NUM_GPUS is a violation of the limit), sleeps HOLD_S, unmarks and exits. Every event is
one JSON line appended to JOURNAL. Prints "ready" once the devices are held.
"""
import json
import os
import sys
import time

t_start = time.time()
n, journal, busy_dir, hold_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
name = sys.argv[5] if len(sys.argv) > 5 else str(os.getpid())

from eagledata.extract import gpus  # noqa: E402

ids = gpus.claim_gpus(n, os.environ["EAGLEDATA_GPU_LOCK_DIR"], poll_s=0.05, timeout_s=120)
t_claimed = time.time()


def log(**rec):
    line = json.dumps({"name": name, "pid": os.getpid(), "t": time.time(), **rec}) + "\n"
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


violations = []
if os.environ.get("CUDA_VISIBLE_DEVICES") != ",".join(ids):
    violations.append(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} != {ids}")
if len(ids) != n:
    violations.append(f"asked {n}, got {ids}")
marked = []
for g in ids:
    try:
        os.close(os.open(os.path.join(busy_dir, f"busy-{g}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        marked.append(g)
    except FileExistsError:
        violations.append(f"device {g} already held by another job")
limit = int(os.environ.get("EAGLEDATA_NUM_GPUS", "8"))
in_use = len([f for f in os.listdir(busy_dir) if f.startswith("busy-")])
if in_use > limit:
    violations.append(f"{in_use} devices in use > limit {limit}")
log(event="claim", ids=ids, wait_s=t_claimed - t_start, in_use=in_use, violations=violations)
print("ready", flush=True)
time.sleep(hold_s)
for g in marked:
    os.unlink(os.path.join(busy_dir, f"busy-{g}"))
log(event="release", ids=ids)
