"""tests/differential/user_code.py written with `import lightning as L`, as Lightning's documentation
writes it today: the same classes, each of them of the `lightning` package (`L.LightningModule`,
`L.LightningDataModule`, `lightning.pytorch.callbacks.Callback`).

Made from user_code.py's source when imported, its imports changed (`written_with_lightning`), so the
two cannot drift apart; its classes live in this module (`tests.differential.user_code_lightning.<name>`).
"""

from __future__ import annotations

import re
from pathlib import Path

SOURCE = Path(__file__).with_name("user_code.py")
IMPORTS = {
    "import pytorch_lightning as pl\n": "import lightning as L\n",
    "from pytorch_lightning.callbacks import Callback\n": "from lightning.pytorch.callbacks import Callback\n",
}


def written_with_lightning(source: str) -> str:
    """user_code.py's source with `import lightning as L` and `L.` for `pl.`."""
    for old, new in IMPORTS.items():
        assert old in source, f"user_code.py no longer has {old!r}: update IMPORTS"
        source = source.replace(old, new)
    left = re.findall(r"^\s*(?:from|import) (?:pytorch_lightning|lightning_fabric)\b.*", source, re.M)
    assert not left, f"user_code.py imports {left}: add it to IMPORTS"
    return re.sub(r"\bpl\.", "L.", source)


exec(compile(written_with_lightning(SOURCE.read_text()), str(SOURCE), "exec"))
