import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages from source, even without the editable install: the controller, the tools and the training helper.
sys.path.insert(0, str(ROOT / "functions" / "training"))
sys.path.insert(0, str(ROOT / "functions" / "tools"))
sys.path.insert(0, str(ROOT / "functions" / "controller"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import botocore.session  # noqa: E402

from preemptor_tools.local.moto_patches import sdk  # noqa: E402

# moto resets boto3's default session with each mock, and each new session reads and parses
# botocore's model files again (~0.1 s a client on a 2-CPU machine, in every test that
# mocks AWS by itself): the tests' sessions share one loader of those files, as the
# emulated stack's sessions do while its patches are installed.
botocore.session.create_loader = sdk.shared_loader
