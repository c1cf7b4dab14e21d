# shiv preamble of onbox.pyz: runs after shiv put the extraction on sys.path, before onbox's entry point (first
# starts only; warm starts take onbox.platform.extractroot.start()'s direct path). shiv passes `site_packages`.
import sys

from onbox.platform.extractroot import hold_and_clean

sys.dont_write_bytecode = False  # our private extraction: cache bytecode even under PYTHONDONTWRITEBYTECODE
hold_and_clean(str(site_packages.parent))  # type: ignore[name-defined]  # noqa: F821
