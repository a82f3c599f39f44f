"""SGLang's offline Engine behind the rollout protocol (optional: `pip install 'colocate[sglang]'`)."""
