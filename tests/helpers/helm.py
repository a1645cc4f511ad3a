"""Where the tests find helm: $TANDEM_HELM, then scripts/get-helm.sh's .cache/helm/helm, then PATH."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def find_helm() -> str | None:
    for candidate in (os.environ.get("TANDEM_HELM"), str(REPOSITORY / ".cache" / "helm" / "helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("helm")
