"""What can be converted: an ImageFolder tree (``folder``, its sidecar files in ``sidecars``) and
CSV / JSON Lines manifests (``manifest``, their rows read by ``rows``), each scanned into the
samples of ``samples``; the safe file read every source uses (``reading``); where an export
writes a manifest's images (``export_layout``). Sources only read."""
