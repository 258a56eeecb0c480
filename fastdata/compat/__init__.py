"""Drop-in shapes of the recipes people come from, on top of fastdata's loader.

- :mod:`fastdata.compat.apex`: ``data_prefetcher(loader)`` with apex's ``.next()`` loop.
- :mod:`fastdata.compat.timm`: ``create_loader(dataset, input_size, batch_size, ...)`` with
  timm's signature.

``fastdata.loaders.BackgroundGenerator`` is already a drop-in for prefetch_generator's. See
``docs/migrating.md`` for each recipe next to its fastdata form.
"""
