// Package ganesha renders nfs-ganesha export files, drives a running
// ganesha over D-Bus, and runs and supervises a private ganesha with its own
// private message bus.
//
// # Export files
//
// Every volume is one file holding exactly one EXPORT block (Export.Render,
// WriteExportFile). The export itself grants nobody anything
// (Access_Type = None); every client is a single IP address in a CLIENT block
// of its own with Access_Type = RW or RO. A client that is not listed does
// not even see the export (NFS4ERR_NOENT); a read-only client gets
// NFS4ERR_ROFS when it writes. Wildcards, networks, host names and netgroups
// cannot be expressed. Every string that reaches the file is checked against
// a small character set first, so no value can close a block, start a new
// one or add a parameter.
//
// # Order of operations
//
// ganesha's configuration includes the export directory with %dir, and a
// SIGHUP or a restart makes ganesha serve exactly what is on disk: it drops
// every export that has no file, including ones added over D-Bus. So the
// file is always written first (WriteExportFile) and ganesha is told
// afterwards (Control.ApplyExport); to withdraw an export, remove the file,
// then call Control.RemoveExport. A restart is then a no-op.
//
// %dir includes every file in the directory, hidden ones too, and one file
// that does not parse makes ganesha drop every export on SIGHUP and refuse to
// start. The export directory must therefore hold export files only. The
// temporary files of WriteExportFile (".<name>.tmp-*") are removed by the
// Server before each start of ganesha.
//
// # D-Bus
//
// Control talks to org.ganesha.nfsd at /org/ganesha/nfsd/ExportMgr
// (interface org.ganesha.nfsd.exportmgr). Errors ganesha reports come back
// as *Error carrying ganesha's own message; IsNotFound and IsNotRunning
// classify them.
//
// # Server
//
// StartServer runs dbus-daemon with a configuration of its own (a bus only
// root may join, on which only root may own org.ganesha.nfsd) and
// ganesha.nfsd in the foreground with DBUS_SYSTEM_BUS_ADDRESS pointing at
// that bus, both children of the calling process, each in its own process
// group, and neither outlives it: they are started with a parent-death
// signal from a thread that lives as long as the process (spawn.go), and a
// start stops whatever an earlier Server left running on the same runtime
// directory, found by the configuration files its command line names.
//
// ganesha is configured for NFSv4 only, with numeric owners, with
// Mount_Path_Pseudo so that D-Bus reports pseudo paths, and with its
// recovery database (the fs backend) in the runtime directory: after a
// restart with clients it knew, it is in grace until they reclaimed their
// opens and locks or GracePeriod passed, so that no other client can take a
// lock in between; with none it is not in grace at all (what ganesha 4.3
// does in detail is next to DefaultGracePeriod). Control.InGrace and
// Control.WaitGraceEnded tell when grace is over. If ganesha exits while the
// Server runs, it is started again after a short backoff and comes back with
// every export found in the export directory and the clients in its
// recovery database.
//
// Server.Pause holds ganesha still (SIGSTOP, then until every thread is
// stopped) and resumes it (SIGCONT) when its caller says or a bound passes,
// whichever is first, so that a copy of what it serves can be taken at one
// instant; the supervisor only acts on an exit, which a stopped process
// does not make, and Stop continues a paused ganesha so that it acts on
// SIGTERM.
package ganesha
