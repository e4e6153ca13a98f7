"""The deployment test of ``k8s/`` (``scripts/deploy-test.sh``): its pods as Docker containers."""
