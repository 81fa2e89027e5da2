"""Reports: the self-contained HTML report of runs or a sweep (``report``), the pieces every
page is built from (``page``: styles, tables, figures as data URIs; also used by the diagnostics
and gradcheck), and ``timlab demo`` (``demo``: pretrain, the VeXact sweep, the report)."""
