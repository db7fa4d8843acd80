"""Starts kserve_linear.py's model under KServe's own ModelServer, N worker processes,
as a KServe script's `__main__` does, with one change: KServe 0.21's parent kills a
worker that does not answer its liveness ping within 5 s, and then starts another, and
a worker's start (it imports kserve and torch anew) took 8 s on the shared 2-core
machine this was measured on, so no worker ever served; here the ping waits up to 60 s.
A worker that has started answers at once, as before.

    python kserve_server.py PORT WORKERS
"""
import sys

import kserve
from kserve.protocol.rest.multiprocess.server import RESTServerProcess
from kserve_linear import Linear  # beside this file

if __name__ == "__main__":
    RESTServerProcess.is_alive.__defaults__ = (60,)
    kserve.ModelServer(http_port=int(sys.argv[1]), workers=int(sys.argv[2]),
                       enable_grpc=False, enable_latency_logging=False).start([Linear()])
