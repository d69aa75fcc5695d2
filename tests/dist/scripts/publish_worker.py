"""Worker for tests/dist/test_publish.py: ``publish_collectively`` over real gloo ranks.

Job ``publish`` of tests/dist/harness.py (2 ranks): argv = OUT_DIR
Every case publishes OUT_DIR/cases/CASE/final (its own parent dir). Per case each
rank records what the call did (``"ok"`` or the exception's type and message) and
the listing of the case's parent dir after the call (every rank waits for the
others first); rank 0 also records the published ``COMPLETE.json``. Each rank
writes its results to OUT_DIR/rank{R}.json.
"""

import json
import os
import zlib

import torch.distributed as dist

from megatron_rl.infra.checkpoint_root import MARKER_NAME, crc32_hex, temp_dir_for
from megatron_rl.infra.publish import publish_collectively

FORMAT = "publish_test"


def payload(case: str, rank: int) -> bytes:
    return (f"case {case}, rank {rank}\n" * (10 * (rank + 1))).encode()


def writer(case: str, rank: int, fail_rank=None, name="rank{r}.bin"):
    """``write(tmp)``: this rank's file; raises on ``fail_rank`` after the others wrote theirs.
    Rank 0 returns the CRC-32 it knows (the path publish_collectively uses instead of a read-back)."""
    def write(tmp: str):
        if rank == fail_rank:
            raise ValueError(f"boom on rank {rank}")
        rel = name.format(r=rank)
        data = payload(case, rank)
        with open(os.path.join(tmp, rel), "wb") as f:
            f.write(data)
        return {rel: crc32_hex(zlib.crc32(data))} if rank == 0 else None
    return write


def seal_ok(case: str):
    def seal(tmp: str) -> dict:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"case": case}, f)
        return {"format": FORMAT, "case": case}
    return seal


def seal_fail(tmp: str) -> dict:
    raise ValueError("seal broke")


def listing(parent: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(parent):
        rel = os.path.relpath(d, parent)
        for name in dirs:
            out.append(os.path.normpath(os.path.join(rel, name)) + "/")
        for name in files:
            out.append(os.path.normpath(os.path.join(rel, name)))
    return sorted(out)


def main(argv):
    out_dir = argv[0]
    rank = dist.get_rank()
    results = {}

    def parent_of(case: str, old_file: bool = False) -> str:
        parent = os.path.join(out_dir, "cases", case)
        if rank == 0:
            os.makedirs(parent, exist_ok=True)
            if old_file:
                os.makedirs(os.path.join(parent, "final"))
                with open(os.path.join(parent, "final", "old.bin"), "wb") as f:
                    f.write(b"old content\n")
        dist.barrier()
        return parent

    def run(key: str, parent: str, write, seal, verify=None):
        final = os.path.join(parent, "final")
        try:
            publish_collectively(final, write, seal, verify)
            outcome = {"type": "ok", "message": ""}
        except BaseException as e:  # noqa: BLE001 - recorded and asserted by the test
            outcome = {"type": type(e).__name__, "message": str(e)}
        dist.barrier()  # every rank is done with the call before anyone looks at the disk
        outcome["listing"] = listing(parent)
        outcome["temp_dir_exists"] = os.path.isdir(temp_dir_for(final))
        marker = os.path.join(final, MARKER_NAME)
        if rank == 0 and os.path.isfile(marker):
            with open(marker) as f:
                outcome["marker"] = json.load(f)
        results[key] = outcome
        dist.barrier()  # the next case starts after every rank listed this one

    # 1. success: every rank writes its own file, rank 0 seals
    run("success", parent_of("success"), writer("success", rank), seal_ok("success"))

    # 2. write fails on rank 1 only; then a retry in the same dir clears the failed attempt's temp dir
    p = parent_of("write_fail")
    run("write_fail", p, writer("write_fail", rank, fail_rank=1), seal_ok("write_fail"))
    run("retry_after_write_fail", p, writer("retry", rank, name="retry{r}.bin"), seal_ok("retry"))

    # 3. seal fails on rank 0
    run("seal_fail", parent_of("seal_fail"), writer("seal_fail", rank), seal_fail)

    # 4. verify fails on every rank
    def verify_fail(tmp: str) -> None:
        raise RuntimeError(f"verify mismatch on rank {rank}")
    run("verify_fail", parent_of("verify_fail"), writer("verify_fail", rank), seal_ok("verify_fail"), verify_fail)

    # 5. replacing an existing final/: success swaps in only the new files ...
    p = parent_of("replace", old_file=True)
    run("replace_ok", p, writer("replace", rank), seal_ok("replace"))
    # ... and a failed write later leaves the published dir as it was
    run("replace_ok_then_fail", p, writer("replace_again", rank, fail_rank=1, name="again{r}.bin"),
        seal_ok("replace_again"))
    # 5b. a failed write over a final/ holding an old file leaves that file
    run("replace_fail", parent_of("replace_fail", old_file=True),
        writer("replace_fail", rank, fail_rank=1, name="new{r}.bin"), seal_ok("replace_fail"))

    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(results, f, indent=1)
    os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))
