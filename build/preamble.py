# shiv preamble of onbox.pyz: runs after shiv put the extraction on sys.path, before onbox's entry point.
# shiv passes `site_packages` (a Path to <root>/<pyz>_<build>/site-packages). See onbox/extractroot.py.
from onbox.extractroot import hold_and_clean

hold_and_clean(str(site_packages.parent))  # type: ignore[name-defined]  # noqa: F821
