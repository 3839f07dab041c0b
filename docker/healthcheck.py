#!/usr/bin/env python3
"""Container HEALTHCHECK: exit 0 when GET /health on this container's server answers 200.

The server listens on $PORT (default 8080); the check always asks the loopback address, whatever
--hostname the server binds (0.0.0.0 in the images).
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('PORT') or '8080'}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
