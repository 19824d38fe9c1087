"""Install kmix: `pip install .` (library), `.[test]` (with tests), `.[gpu]` (NVIDIA GPUs: CUDA libraries and pytest)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(
    r'^__version__ = "([^"]+)"',
    (HERE / "kmix" / "__init__.py").read_text(),
    re.MULTILINE,
).group(1)

TEST_TOOLS = ["pytest>=7", "absl-py"]

setup(
    name="kmix",
    version=VERSION,
    description="Safe and fast mixed-precision training for Keras 3 (TensorFlow backend).",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["kmix", "kmix.*"]),
    python_requires=">=3.11",
    # The floors are what is tested: `.ci/floor` runs the placement, reload and optimizer tests under
    # them (Keras 3.10-3.11 match DTypePolicyMap keys with re.search, which misplaces reloads; on
    # TF 2.17 XLA:CPU drops the float32 -> half -> float32 casts the master weights rely on).
    install_requires=[
        "tensorflow>=2.21",
        "keras>=3.12",
        "numpy",
        "matplotlib",
    ],
    extras_require={
        # pytest-xdist: the suite on 2 processes, a test file each (-n 2 --dist loadfile);
        # tensorboard: the TensorBoard callback test; keras-hub: autocast on real backbones
        # (built from constructor arguments: no presets, no downloads).
        "test": [*TEST_TOOLS, "pytest-xdist", "tensorboard", "keras-hub>=0.32"],
        # tensorflow[and-cuda]: the CUDA runtime, cuDNN and the rest TensorFlow was built against
        # (plain `tensorflow` brings none: with only the driver it sees no GPU); pytest: for
        # `python -m kmix bench gpu`, which runs the tests marked gpu.
        "gpu": ["tensorflow[and-cuda]>=2.21", *TEST_TOOLS],
    },
    entry_points={"console_scripts": ["kmix=kmix.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Framework :: Keras",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
