"""The verbs: ``convert`` (and ``append``), ``copy``, ``export``, ``verify``, ``info``, ``bench``.
Only this layer combines sources, images and stores; each verb is one call that returns a typed
report, and logs rather than prints."""
