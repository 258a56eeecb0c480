"""What can be converted: an ImageFolder tree (``folder``, with the safe file read every source
uses) and CSV / JSON Lines manifests (``manifest``). Sources only read."""
