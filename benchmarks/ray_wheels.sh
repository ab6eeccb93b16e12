#!/usr/bin/env bash
# Ray for the GPU machine (Python 3.12, x86-64, no package registry), in two parts: the Ray
# wheel (~76 MiB) is larger than one device call carries (64 MiB with the checkout).
#
# Here, in the checkout's root:  bash benchmarks/ray_wheels.sh
#   writes .raywhl/p0 (part 0 of the Ray wheel, ~38 MiB) and .raywhl/p1 (part 1, ~38 MiB,
#   plus jsonschema and its three dependencies, the only ones of Ray's the image lacks) and
#   ignores .raywhl/ in git.
# On the GPU machine, two calls back to back (its /tmp lasts while it stays warm):
#   call 1, carry .raywhl/p0:  bash .raywhl/p0/stage.sh
#   call 2, carry .raywhl/p1 (plus .whl with asyncserve's own wheels):
#     bash .raywhl/p1/install.sh && export PYTHONPATH=/tmp/site_ray:$PYTHONPATH && ...
set -euo pipefail
cd "$(dirname "$0")/.."
RAY=ray==2.60.0
OUT=.raywhl
grep -qx '/.raywhl/' .git/info/exclude 2>/dev/null || echo '/.raywhl/' >> "$(git rev-parse --git-path info/exclude)"
rm -rf "$OUT" && mkdir -p "$OUT/dl" "$OUT/p0" "$OUT/p1"
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLAT[@]}" -d "$OUT/dl" "$RAY" jsonschema referencing \
    jsonschema-specifications rpds-py
wheel=$(ls "$OUT"/dl/ray-*.whl)
name=$(basename "$wheel")
size=$(stat -c %s "$wheel")
split -n 2 -d -a 1 "$wheel" "$OUT/part"
mv "$OUT/part0" "$OUT/p0/part0"
mv "$OUT/part1" "$OUT/p1/part1"
mv "$OUT"/dl/*.whl "$OUT/p1/" && rm "$OUT/p1/$name" && rmdir "$OUT/dl"
cat > "$OUT/p0/stage.sh" <<'STAGE'
#!/usr/bin/env bash
mkdir -p /tmp/raystage && cp "$(dirname "$0")/part0" /tmp/raystage/ && ls -la /tmp/raystage
STAGE
cat > "$OUT/p1/install.sh" <<INSTALL
#!/usr/bin/env bash
# Joins the Ray wheel ($name, $size bytes) and installs it with its missing dependencies.
set -euo pipefail
here="\$(dirname "\$0")"
if [[ -d /tmp/site_ray/ray ]]; then python3 -c "import sys; sys.path.insert(0, '/tmp/site_ray'); import ray; print('ray', ray.__version__)"; exit 0; fi
[[ -f /tmp/raystage/part0 ]] || { echo "run .raywhl/p0/stage.sh first (the machine went back?)"; exit 1; }
cat /tmp/raystage/part0 "\$here/part1" > "/tmp/raystage/$name"
[[ \$(stat -c %s "/tmp/raystage/$name") == $size ]] || { echo "joined wheel has the wrong size"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_ray \\
    "/tmp/raystage/$name" "\$here"/*.whl
PYTHONPATH=/tmp/site_ray python3 -c "import ray, ray.data; print('ray', ray.__version__)"
INSTALL
du -sh "$OUT"/p0 "$OUT"/p1
