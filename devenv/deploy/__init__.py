"""The local deployment test of ``k8s/``: the manifests' pods as ``docker run`` calls on one host.

``manifests`` reads ``k8s/*.yaml``, ``pods`` translates a pod template (pure), ``docker`` runs
containers as a kubelet would, ``checks`` counts what the pods wrote, ``deployment`` holds one
test's state and table, ``scenario`` is its steps (``python -m devenv.deploy``, run by
``scripts/deploy-test.sh``).
"""
