"""Entry script for ``spark-submit`` (absolute imports, so it runs as ``__main__``)::

    logjam-relay pipeline package /tmp/logjam_relay.zip
    spark-submit --master spark://host:7077 --py-files /tmp/logjam_relay.zip \
        "$(python -c 'import logjam_relay.pipeline.submit as m; print(m.__file__)')" \
        stats --input /shared/archive --output /shared/stats
"""

import sys

from logjam_relay.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
