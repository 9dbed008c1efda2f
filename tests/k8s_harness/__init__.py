"""A cluster in a test process, to run the Helm chart the way Kubernetes runs it.

``Cluster`` (cluster.py) holds an object store (store.py) behind a real HTTPS API server on 127.0.0.1
(apiserver.py: bearer-token authentication, RBAC from the rendered Roles, the API's defaulting
(admission.py), strict schema validation, immutable fields, discovery and Tables for the real
kubectl — ``Cluster.kubectl`` —, and the protobuf bodies of kubectl's typed commands, decoded with the
schema inside kubectl itself: protobuf.py), a Job controller, a CronJob trigger, a garbage collector and an
optional Kueue-like queue admission (controllers.py), and a kubelet that runs every container of
every pod as a local process with the rendered command, args, env, volumes and working directory, as
the pod's user, in its image target's own Python environment (kubelet.py; the image's
ENTRYPOINT/WORKDIR/ENV/USER come from the Dockerfile, its packages from ``docker/install.sh``,
image.py). ``Cluster.helm`` installs, upgrades, tests and uninstalls releases with Helm's
own template engine (helm.py). Each module's docstring lists what it reproduces and where it departs
from a real cluster (path rewriting into volumes, pod DNS names → 127.0.0.1, shortened back-off).

Nothing here knows about sapd's stages: the pipeline driver pod finds the API server through the
kubeconfig every pod gets, and talks to it with the real ``kubernetes`` client.
"""

from .cluster import Cluster
from .helm import HelmError

__all__ = ["Cluster", "HelmError"]
