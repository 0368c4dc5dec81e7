"""torch's flight recorder, written when hpctrain ends a job that hangs.

With `TORCH_NCCL_TRACE_BUFFER_SIZE` (or `TORCH_FR_BUFFER_SIZE`) set, every rank keeps its last
collectives in memory: which process group, which operation, which sizes, issued, started or completed.
torch writes them out (`TORCH_NCCL_DUMP_ON_TIMEOUT`) only when NCCL's own watchdog finds a collective
timed out; hpctrain's watchdog declares a hang and ends the job before that timeout (with every rank's
stacks and a sentence naming the rank that did not arrive), so torch's dump never came. With async NCCL
a rank's Python stack shows its next host sync, not the stuck collective: the record is what does.
So every rank writes its record itself, beside its stacks, before the job ends (`dump`): to the file
torch's own dump would write, `<TORCH_FR_DUMP_TEMP_FILE><rank>` (`<run dir>/flight_recorder/rank<N>`,
hpctrain.runtime.environment.network), in torch's format, which its reader reads:
`torchfrtrace <run dir>/flight_recorder --prefix rank`.

The records are read through torch's private `_dump_nccl_trace` (NCCL's groups, with their
communicators' state) and `_dump_fr_trace` (gloo's, torch 2.8 and later): hpctrain.runtime.internals.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from hpctrain.runtime.distributed.job_store import rank

BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_PREFIX = "TORCH_FR_DUMP_TEMP_FILE"
DUMP_S = 10.0  # at most this long for a dump (torch symbolises C++ stacks): the job must still end


def recording() -> bool:
    """Whether torch keeps a flight record in this process (a buffer size above 0 was set)."""
    return any(os.environ.get(name, "0").strip() not in ("", "0") for name in BUFFER_VARIABLES)


def _record() -> bytes | None:
    """This process's record, pickled as torch writes it: NCCL's where the job runs on NCCL, else
    gloo's (None where this torch keeps none for the backend)."""
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    read = getattr(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None)
    return read() if read is not None else None


def dump() -> Path | None:
    """Write this rank's flight record to `<TORCH_FR_DUMP_TEMP_FILE><rank>` now (from any thread), whole
    (a reader never sees half of it); the file, or None where nothing is recorded or nowhere to write.
    Bounded by `DUMP_S`: a dump that does not come leaves the job to end without it."""
    prefix = os.environ.get(DUMP_PREFIX)
    if not prefix or not recording():
        return None
    target = Path(f"{prefix}{rank()}")
    written: list[Path] = []

    def write() -> None:
        try:
            record = _record()
            if record is None:
                return
            partial = target.with_name(f".{target.name}.partial")
            partial.write_bytes(record)
            os.replace(partial, target)
            written.append(target)
        except Exception:  # a torch that cannot dump now: the job ends with its stacks and sentence
            return

    thread = threading.Thread(target=write, name="flight-recorder-dump", daemon=True)
    thread.start()
    thread.join(DUMP_S)
    return written[0] if written else None
