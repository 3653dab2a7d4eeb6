"""Hardware profiles: data only (GPU and interconnect YAML files), shipped inside the wheel.

``gpu/<name>.yaml`` and ``interconnect/<name>.yaml``; every number carries its unit in its
name and its source beside it.  Read them with :mod:`autoplace.specs.cluster`.
"""
