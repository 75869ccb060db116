"""``scroll console``: a web console of a Scroll cluster (issue 27).

How this works. The console is a Starlette app (``app.py``) with server-rendered Jinja2 templates
(``templates/``) and a little JavaScript of its own plus uPlot (``static/vendor/``, vendored: no CDN,
works offline). It reads what it shows on page view, directly from the metadata store through the
streams client and the Kafka layer's own records (``data.py``: streams, fragments, bookies, Kafka
listeners and their partitions, consumer groups' committed offsets) and, for live members, lag
resets and deletes, from the Kafka listener over the Kafka protocol (``KafkaAdmin``). Graphs come from
a bounded ring of samples that the console collects itself from the processes' /metrics endpoints
(``timeseries.py``: 1 h at 10 s), so no Prometheus server is needed and /metrics stay the truth.
Nothing runs on a timer but that scrape: no listing of every stream's fragments in the background.

``--secure`` (``auth.py``): TLS, a login (a Kafka SCRAM user, checked against its stored SCRAM
credential, or a token), the Kafka ACLs checked for every page and action, CSRF tokens on every
POST, and SIGHUP re-reads the certificate (``fragments/tlsreload.py``). Without it the console binds
loopback only and says so on every page.
"""
