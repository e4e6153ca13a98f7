"""The local deployment test of ``k8s/``: the manifests' pods as ``docker run`` calls on one host.

``pods`` translates (pure), ``docker`` runs containers, ``checks`` counts what the pods wrote,
``scenario`` is ``scripts/deploy-test.sh``'s test (``python -m devenv.deploy``).
"""
