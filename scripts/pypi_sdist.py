#!/usr/bin/env python3
"""Downloads one source package from PyPI's simple API into a folder and prints its path.

`pip download` would build the package's metadata (for llama-cpp-python: scikit-build-core and a
compiler) just to download it; the JSON simple API gives the file's URL directly. Used by
scripts/fetch-llamacpp-src.sh and scripts/fetch-llamacpp.sh.

  python3 scripts/pypi_sdist.py OUT_DIR NAME VERSION
"""

import json
import sys
import urllib.request


def main() -> None:
    out, name, version = sys.argv[1:]
    req = urllib.request.Request(
        f"https://pypi.org/simple/{name}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req) as r:
        files = json.load(r)["files"]
    want = f"{name.replace('-', '_')}-{version}.tar.gz"
    url = next((f["url"] for f in files if f["filename"] == want), None)
    if url is None:
        sys.exit(f"pypi_sdist: {want} is not on PyPI's index for {name}")
    urllib.request.urlretrieve(url, f"{out}/{want}")
    print(f"{out}/{want}")


if __name__ == "__main__":
    main()
