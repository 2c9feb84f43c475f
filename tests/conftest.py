import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages from source, even without the editable install: the controller, the tools and the training helper.
sys.path.insert(0, str(ROOT / "functions" / "training"))
sys.path.insert(0, str(ROOT / "functions" / "tools"))
sys.path.insert(0, str(ROOT / "functions" / "controller"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
