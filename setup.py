"""Install kmix: `pip install .` (library) or `pip install .[test]` (with tests)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(
    r'^__version__ = "([^"]+)"',
    (HERE / "kmix" / "__init__.py").read_text(),
    re.MULTILINE,
).group(1)

setup(
    name="kmix",
    version=VERSION,
    description="Safe and fast mixed-precision training for Keras 3 (TensorFlow backend).",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["kmix", "kmix.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.16",
        "keras>=3.10",
        "numpy",
        "matplotlib",
    ],
    extras_require={
        # pytest-xdist: the suite on 2 processes, a test file each (-n 2 --dist loadfile);
        # tensorboard: the TensorBoard callback test; keras-hub: autocast on real backbones
        # (built from constructor arguments: no presets, no downloads).
        "test": ["pytest>=7", "pytest-xdist", "absl-py", "tensorboard", "keras-hub>=0.20"],
    },
    entry_points={"console_scripts": ["kmix=kmix.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Framework :: Keras",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
