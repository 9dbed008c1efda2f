"""The trajectory formats sapd reads (docs/FORMATS.md), one module each: a parser and its ``FORMAT`` entry
(:class:`~sapd.data.formats.base.TrajectoryFormat`). The registry is :data:`sapd.data.loaders.FORMATS`;
adding a format is a module here and one entry there."""
