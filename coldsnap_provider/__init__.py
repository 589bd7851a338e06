"""coldsnap-provider: the ColdSnap host provider daemon.

The public surface besides the CLI: a strict client of the format-1 envelope (what the
Go controller does, used by the tests, the benchmarks and `coldsnap-provider call`), the
envelope's request decoder and reply type, and the JSON Schema generator. Placement managers
import ``coldsnap_provider.client`` (typed, async: docs/control-protocol.md).
"""

__version__ = "0.1.0"

# After __version__: the modules below import it.
from ._client import call as call
from ._client import call_control as call_control
from ._client import exchange as exchange
from ._control import decode_control as decode_control
from ._envelope import Reply as Reply
from ._envelope import Runtime as Runtime
from ._envelope import decode_request as decode_request
from ._errors import ProtocolError as ProtocolError
from ._errors import ReplyError as ReplyError
from ._schemas import generate as generate_schemas

__all__ = (
    "ProtocolError",
    "Reply",
    "ReplyError",
    "Runtime",
    "__version__",
    "call",
    "call_control",
    "decode_control",
    "decode_request",
    "exchange",
    "generate_schemas",
)
