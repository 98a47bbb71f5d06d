"""The packages a wheel holds: ``capyctl`` and ``hostagent`` as found, and the pages'
templates and assets, which stay at the top of the tree (``templates/``, ``static/``) and
travel inside the package as ``capyctl/_web/`` (``capyctl/settings.py`` finds them either
way). Everything else is declared in ``pyproject.toml``."""

from pathlib import Path

from setuptools import find_packages, setup

# Each folder of the pages' files is a package of data, named as its place in capyctl/_web.
WEB = {"templates": ("*.html", "*.txt"), "static": ("*.css", "*.js", "*.svg", "*.ico", "*.png")}
web_packages = {
    ".".join(("capyctl", "_web", *folder.parts)): patterns
    for top, patterns in WEB.items()
    for folder in sorted({Path(top), *(p.relative_to(".") for p in Path(top).rglob("*/"))})
    if folder.is_dir()
}

setup(
    packages=[
        *find_packages(include=["capyctl", "capyctl.*", "hostagent", "hostagent.*"]),
        *web_packages,
    ],
    package_dir={f"capyctl._web.{top}": top for top in WEB},
    package_data={name: list(patterns) for name, patterns in web_packages.items()},
)
