"""Serving Cuvil artifacts over HTTP with the Open Inference Protocol (KServe v2) on Ray Serve (issue 26).

``protocol`` parses and encodes OIP requests and responses (JSON tensors and the binary-data extension) and
knows no Ray; ``batching`` joins requests along the artifact's symbolic batch dim and splits the outputs back
(no Ray either); ``deployment`` holds the Ray Serve deployments (the HTTP ingress, one deployment per model);
``app`` builds the application and starts Ray and Serve. Ray is imported only by ``deployment`` and ``app``,
and only when a server is built: ``import cuvil`` and ``import cuvil.serve`` never need it
(``pip install 'cuvil[serve]'`` adds it). docs/serving.md shows the use.
"""
