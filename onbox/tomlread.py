"""Read TOML on every supported Python: tomllib from 3.11, the bundled tomli before (shiv resolves
markers at build time, so tomli is shipped explicitly). Files are read through onbox.untrusted: regular files
only, a size bound, a nesting bound."""
from __future__ import annotations

import sys
from typing import Any, Dict

from onbox import untrusted
from onbox.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - exercised by the zipapp test under 3.8-3.10
    import tomli as _toml


def load_toml(path: str, what: str = "file", limit: int = untrusted.CONFIG_MAX_BYTES) -> Dict[str, Any]:
    """Parse a TOML file; a missing, oversized, non-regular or malformed file is a UsageError naming the file and
    the problem. A UTF-8 byte-order mark (Notepad writes one) is accepted."""
    try:
        text = untrusted.read_text(path, limit, what)
        doc = _toml.loads(text)
        return untrusted.check_depth(doc, "%s %s" % (what, path))
    except FileNotFoundError:
        raise UsageError("%s not found: %s" % (what, path))
    except IsADirectoryError:
        raise UsageError("%s %s is a directory, not a file" % (what, path))
    except UnicodeDecodeError as e:  # TOML is UTF-8 by definition; an editor saved it as UTF-16 or Latin-1
        raise UsageError("%s %s is not UTF-8 text (byte %d): %s" % (what, path, e.start, e.reason),
                         hint="save it as UTF-8")
    except untrusted.UntrustedInput as e:
        raise UsageError(str(e), hint="give the path of a TOML file")
    except RecursionError:
        raise UsageError("%s %s nests too deeply to be a configuration file" % (what, path))
    except _toml.TOMLDecodeError as e:
        raise UsageError("%s %s is not valid TOML: %s" % (what, path, e), hint="fix the syntax at the line named")
    except OSError as e:
        raise UsageError("cannot read %s %s: %s" % (what, path, e.strerror or e))
