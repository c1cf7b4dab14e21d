"""torch.distributed.checkpoint directories (also Lightning's FSDP dirs): `*.distcp` shards and `.metadata`,
written last by the coordinator once every rank saved. Complete when `.metadata` is there.
"""
from __future__ import annotations

from typing import List, Optional

from onbox.checkpoints.formats.base import Format, Layout

DCP_MARKER = ".metadata"


class DcpFormat(Format):
    name = "dcp"

    def layout(self, path: str, files: List[str]) -> Optional[Layout]:
        top = {f for f in files if "/" not in f}
        if DCP_MARKER in top:
            return Layout(self.name, None, "%s present (written last)" % DCP_MARKER)
        if any(f.endswith(".distcp") for f in top):
            return Layout(self.name, "no %s yet (torch.distributed.checkpoint writes it last)" % DCP_MARKER)
        return None


FORMAT = DcpFormat()
