"""Write scikit-learn's digits as an image folder (PNG and JPEG files): data=image_folder to try, offline.

python scripts/make_demo_images.py                       # -> data/digits_images/{train,val,test}/<digit>/
python src/train.py experiment=image_folder_demo         # train on the folder
python scripts/make_shards.py experiment=image_folder_demo --out data/digits_shards
python src/train.py experiment=image_folder_demo data=shards data.root=data/digits_shards
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from myproject.data.digits import write_image_folder  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "data" / "digits_images"
    if out.exists():
        print(f"error: {out} already exists; remove it or name another folder.", file=sys.stderr)
        sys.exit(2)
    write_image_folder(out)
    print(f"{sum(1 for p in out.rglob('*') if p.is_file())} images in {out}")
