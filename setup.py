"""The package's one compiled module, eagledata.tokens.chunkscan (the rest is in pyproject.toml).

Optional: where it cannot be built (no C compiler or Python headers) the package installs without
it and reads streams the Python way, with the same results. The build records the sha256 of its
source in the module (SOURCE_SHA256): eagledata uses a built module only when that matches the
source it expects (a module left from an older source is not used)."""
import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "src/eagledata/tokens/chunkscan.c"
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(ext_modules=[Extension("eagledata.tokens.chunkscan", [SOURCE], optional=True,
                             define_macros=[("CHUNKSCAN_SOURCE_SHA256", f'"{DIGEST}"')])])
