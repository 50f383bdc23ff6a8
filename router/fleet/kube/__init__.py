"""Kubernetes-native worker discovery (``--discovery k8s``).

``pod_workers`` turns one pod into a worker (the annotation contract, pure); ``client_config``
builds a private client configuration (kubeconfig or in-cluster); ``pod_watch`` lists and watches
the pods of each role and writes their workers to the registry. Import ``pod_watch`` lazily: the
Kubernetes client takes most of a second to import.
"""

from __future__ import annotations
