#!/bin/bash
# Device side, one call per payload part (carry .dev/p/partNN and .dev/p/SHA256): move the part
# out of the repo copy into /tmp/stage, which lasts while the machine stays warm.
mkdir -p /tmp/stage && mv .dev/p/part* /tmp/stage/ 2>/dev/null
[ -f .dev/p/SHA256 ] && cp .dev/p/SHA256 /tmp/stage/SHA256
echo "stage: $(ls /tmp/stage | tr '\n' ' ') total $(du -sm /tmp/stage | cut -f1) MiB"
