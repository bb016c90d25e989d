"""The Ray Serve face of the product: the OpenAI-compatible HTTP ingress (``ingress.py``,
``openai_api.py``, ``tokenizer.py``) and Fairway's ``RequestRouter`` (``serve_router.py``), which
hosts the core's routing objects (``fairway.routing``) inside each ingress replica."""
