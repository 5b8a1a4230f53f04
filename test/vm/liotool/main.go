// Command liotool drives package lio inside a test VM, whose kernel has the
// LIO target the host's lacks: the VM tests run it through the VM's agent.
//
//	liotool -prefix P -portal ADDR:PORT export NAME IMAGE SIZE SERIAL
//	liotool -prefix P -portal ADDR:PORT initiators NAME JSON   (a JSON list of lio.Initiator)
//	liotool -prefix P -portal ADDR:PORT show NAME              (prints the access list as JSON)
//	liotool -prefix P -portal ADDR:PORT unexport NAME
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"strconv"

	"github.com/modeguard/modeguard/pkg/backend/block/lio"
)

func main() {
	root := flag.String("root", lio.DefaultRoot, "LIO's configfs directory")
	prefix := flag.String("prefix", "", "IQN prefix of the targets")
	portal := flag.String("portal", "", "address:port the targets listen on")
	flag.Parse()
	if err := run(*root, *prefix, *portal, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "liotool:", err)
		os.Exit(1)
	}
}

func run(root, prefix, portal string, args []string) error {
	ap, err := netip.ParseAddrPort(portal)
	if err != nil {
		return err
	}
	t, err := lio.New(lio.Config{Root: root, Prefix: prefix, Portal: ap})
	if err != nil {
		return err
	}
	if len(args) < 2 {
		return fmt.Errorf("want a command and a volume name")
	}
	name := args[1]
	switch {
	case args[0] == "export" && len(args) == 5:
		size, err := strconv.ParseInt(args[3], 10, 64)
		if err != nil {
			return err
		}
		return t.Export(lio.LUN{Name: name, Image: args[2], Size: size, Serial: args[4]})
	case args[0] == "initiators" && len(args) == 3:
		var want []lio.Initiator
		if err := json.Unmarshal([]byte(args[2]), &want); err != nil {
			return err
		}
		return t.SetInitiators(name, want)
	case args[0] == "show" && len(args) == 2:
		have, err := t.Initiators(name)
		if err != nil {
			return err
		}
		return json.NewEncoder(os.Stdout).Encode(have)
	case args[0] == "unexport" && len(args) == 2:
		return t.Unexport(name)
	}
	return fmt.Errorf("unknown command %q with %d arguments", args[0], len(args)-1)
}
