"""ferrum beyond one machine: replicas on Ray Serve, routed to the replica holding the prefix.

    client ─HTTP─▶ Ray Serve proxy ─▶ FerrumIngress (ingress.py) ─handle─▶ FerrumReplica × N
                                      route key: prompt tokens          (replica.py: the app
                                      → chained block hashes             of `ferrum serve`,
                                      (keys.py)                          in process)
                                      router: routers.py + policy.py ◀── routing stats: the
                                                                         blocks each engine holds

- `settings.py`: `ferrum cluster`'s flags and the settings replicas and the ingress share.
- `app.py`: the Ray Serve application (`build_app`; `app_builder` for `serve run` configs).
- `replica.py`: one ferrum server per replica; its routing stats; its /metrics and /health
  left on the board (`board.py`).
- `ingress.py`: the HTTP front; relays each request to the chosen replica and streams the
  answer back; errors in each dialect's shape when a replica fails.
- `keys.py`: a request's route key, its prompt computed as a replica computes it.
- `policy.py`: the routing policies (ferrum's prefix affinity; Ray Serve LLM's text-prefix
  policy re-implemented), pure; `routers.py`: the same as Ray Serve request routers.
- `command.py`: `ferrum cluster`.

The cluster depends on the server and the engine; nothing outside it imports Ray.
"""
