"""One model file from a sharded (FSDP2) checkpoint folder: a weights-only .ckpt and a .safetensors file.

python scripts/consolidate.py logs/train/runs/<run>/checkpoints/last.ckpt model.ckpt

The folder is checked first (its index and every non-tensor item read as plain data, every shard
present and the one it was saved with); the whole model is then gathered on this one process, without
a process group. The .ckpt works wherever a checkpoint file does (eval, predict, export, init_from,
hpctrain.load); src/eval.py and the others also take the folder itself. Nothing existing is overwritten.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.errors import UserError


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/consolidate.py <checkpoint folder> <output .ckpt>", file=sys.stderr)
        return 2
    from hpctrain.runtime.storage.checkpoints.sharded import consolidate

    try:
        written = consolidate(argv[0], argv[1])
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
