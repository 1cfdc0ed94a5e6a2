"""What a deployment runs and mounts: ``secure_init`` (the init container: CA, certificates,
credentials, ACLs), ``secure`` (that material and the ACL table), ``healthcheck`` (the image's
check), and the compose, Kubernetes, Prometheus and Grafana files beside them."""
