"""Write template.yaml as plain CloudFormation (expanded by aws-sam-translator), for the
linters that see only what SAM generates: the functions' and state machines' roles.

    python tests/transformed_template.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from template_support import sam_transform  # noqa: E402


def main(out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(sam_transform(), indent=1, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
