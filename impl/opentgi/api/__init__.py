"""HTTP side: the Connexion app and one thin handler module per API dialect."""

import warnings

# Connexion 3 imports starlette.testclient (for its `test_client()` helper, which the server never
# calls) and jsonschema's deprecated RefResolver at import time: warnings about Connexion's own
# imports, which a user starting the server can do nothing about. Only those are silenced.
for _message in (r"Using `httpx` with `starlette\.testclient` is deprecated",
                 r"jsonschema\.RefResolver is deprecated",
                 r"jsonschema\.exceptions\.RefResolutionError is deprecated"):
    warnings.filterwarnings("ignore", message=_message, module=r"connexion\.")
del _message
