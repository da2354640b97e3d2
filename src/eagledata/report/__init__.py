"""Reports a person reads: per-dataset and run-wide HTML, the run-wide ``validation.json`` and routing advice.

* :mod:`~eagledata.report.build`: the entry points (:func:`~eagledata.report.build.build_dataset_report`,
  ``build_run_report``, ``build_reports_from_config``, ``python -m eagledata.report.build``); the
  formats are in its docstring;
* :mod:`~eagledata.report.settings`: the ``report`` settings (:func:`~eagledata.report.settings.report_settings`),
  read by the workflow without importing the rest;
* :mod:`~eagledata.report.aggregate`: datasets' validation documents summed into the run-wide one;
* :mod:`~eagledata.report.routing`: routing advice (provider order / ignore) and its YAML block;
* :mod:`~eagledata.report.highlight`: the tokens each reason implicates, tokens decoded into units and
  rendered as HTML chips;
* :mod:`~eagledata.report.charts`: inline SVG charts and summary statistics;
* :mod:`~eagledata.report.samples`: choosing the worst samples and building each one's view;
* :mod:`~eagledata.report.render`: the Jinja template and the rows it shows.
"""
