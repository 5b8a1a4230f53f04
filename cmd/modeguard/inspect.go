package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"

	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/inspect"
)

// stringsFlag collects a repeatable string flag.
type stringsFlag []string

func (s *stringsFlag) String() string     { return strings.Join(*s, ",") }
func (s *stringsFlag) Set(v string) error { *s = append(*s, v); return nil }

// runInspect prints who holds each volume and what the access-mode rules do
// with one more node or workload, from the driver's state on disk.
func runInspect(args []string) error {
	pools := poolFlag{}
	var stateDirs stringsFlag
	var o inspect.Options
	var asJSON bool
	fs := inspectFlagSet(&o, pools, &stateDirs, &asJSON)
	if err := fs.Parse(args); err != nil {
		return err
	}
	o.StateDirs, o.Volumes = stateDirs, fs.Args()
	// A pool directory with a kept filesystem has its records in there:
	// mounted (or found mounted) for as long as this reads, never made,
	// as whichever filesystem its image holds.
	kept := map[string]map[string]string{}
	o.BlockPools = map[string]string{}
	for zone, dir := range pools {
		if _, err := os.Stat(filepath.Join(dir, block.KeptImageName)); err == nil {
			choice, err := block.KeptPoolFilesystem(dir)
			if err != nil {
				return fmt.Errorf("block pool of zone %s: %w", zone, err)
			}
			if kept[choice] == nil {
				kept[choice] = map[string]string{}
			}
			kept[choice][zone] = dir
		} else {
			o.BlockPools[zone] = dir
		}
	}
	for choice, dirs := range kept {
		k, err := block.KeepPools(context.Background(), dirs, choice)
		if err != nil {
			return err
		}
		defer k.Release()
		maps.Copy(o.BlockPools, k.Roots)
	}
	report, err := inspect.Collect(o)
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(report)
	}
	report.WriteText(os.Stdout)
	return nil
}

// inspectFlagSet is the command line of modeguard inspect; the commands
// the documentation gives are checked against it (docs_test.go).
func inspectFlagSet(o *inspect.Options, pools poolFlag, stateDirs *stringsFlag, asJSON *bool) *flag.FlagSet {
	fs := flag.NewFlagSet("modeguard inspect", flag.ContinueOnError)
	fs.BoolVar(asJSON, "json", false, "print JSON, for scripts")
	fs.Var(pools, "block-pool", "ZONE=DIR: a block pool to read volume records from (repeatable)")
	fs.StringVar(&o.NFSExportRoot, "nfs-export-root", "", "the controller's --nfs-export-root, to read NFS volume records from")
	fs.StringVar(&o.NFSExportConfigDir, "nfs-export-config-dir", "", "where the controller writes export files (default <nfs-ganesha-dir>/exports), to read each export's client list")
	fs.Var(stateDirs, "state-dir", "a node plugin's --state-dir, to read its lock files (repeatable: one per node)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: modeguard inspect [flags] [volume-id ...]\n\n"+
			"Prints, for each volume, its backend, zone and modes, the nodes it is attached to, the\n"+
			"workloads holding it on each node, its export's client list, and what the access-mode\n"+
			"rules do with one more node or workload. Reads state files only.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	return fs
}
