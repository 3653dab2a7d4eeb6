"""What every framework's files share: precision and layer helpers (``_common``), strict readers'
helpers (``_readkit``) and the launch scripts (``launch``).  Nothing here knows a framework: the
frameworks' own modules (:mod:`autoplace.frameworks`) render their files, and :mod:`autoplace.bundle`
writes a bundle.
"""
