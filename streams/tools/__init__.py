"""Operator tools built on the client library: the ``scroll`` command line (``cli``), the admin
operations behind it (``admin``), the retention job (``retention``), ``scroll standalone``
(``standalone``) and the local cluster of real processes it and the tests start
(``localcluster``). The client library itself is ``streams``."""
