// Package inspect answers the operator's question "who holds this volume,
// and why was my publish refused?" from the driver's own state on disk: the
// controller's volume records (block pools, the NFS export root), the
// export files ganesha serves, and the lock files of node plugins.
//
// It reads only, takes no lock and needs no running driver, so it works
// while a plugin is stuck or down.
package inspect

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/nodestate"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Options name the state to read.
type Options struct {
	BlockPools         map[string]string // zone -> pool directory, as --block-pool
	NFSExportRoot      string            // as --nfs-export-root
	NFSExportConfigDir string            // where export files are, as --nfs-export-config-dir
	StateDirs          []string          // node plugins' --state-dir, one per node
	Volumes            []string          // only these volume ids (all when empty)
}

// Attachment is one node a volume is attached to.
type Attachment struct {
	Node     nodeid.Node `json:"node"`
	Mode     string      `json:"mode"`
	ReadOnly bool        `json:"readOnly"`
	// Fenced: a network fence cuts the node off the volume's storage.
	Fenced bool `json:"fenced,omitempty"`
}

// Workload is one target path holding the volume on a node.
type Workload struct {
	TargetPath string    `json:"targetPath"`
	Pod        string    `json:"pod,omitempty"`
	Mode       string    `json:"mode"`
	ReadOnly   bool      `json:"readOnly"`
	Since      time.Time `json:"since"`
}

// NodeHold is what one node plugin's lock file says about the volume.
type NodeHold struct {
	Node        string     `json:"node"`
	StateDir    string     `json:"stateDir"`
	StagingPath string     `json:"stagingPath,omitempty"`
	Device      string     `json:"device,omitempty"`
	ReadOnly    bool       `json:"readOnly"`
	Workloads   []Workload `json:"workloads,omitempty"`
}

// Client is one entry of an NFS export's client list.
type Client struct {
	Address string `json:"address"`
	Access  string `json:"access"`
}

// Volume is everything known about one volume.
type Volume struct {
	ID            string       `json:"id"`
	Name          string       `json:"name"`
	Backend       string       `json:"backend"`
	Zone          string       `json:"zone,omitempty"`
	AccessType    string       `json:"accessType"`
	FsType        string       `json:"fsType,omitempty"`
	CapacityBytes int64        `json:"capacityBytes"`
	Modes         []string     `json:"modes"`
	Attachments   []Attachment `json:"attachments"`
	Holds         []NodeHold   `json:"holds"`
	// ExportClients is the client list of the volume's export file (NFS);
	// nil when the file could not be read.
	ExportClients []Client `json:"exportClients,omitempty"`
	// Verdicts say, in words, what the access-mode rules do with one more
	// node or one more workload: what a stuck pod runs into.
	Verdicts []string `json:"verdicts"`
}

// Report is the answer for every volume read.
type Report struct {
	Volumes []Volume `json:"volumes"`
	// Problems are state files that could not be read.
	Problems []string `json:"problems,omitempty"`
}

// Collect reads the state the options name.
func Collect(o Options) (*Report, error) {
	if len(o.BlockPools) == 0 && o.NFSExportRoot == "" && len(o.StateDirs) == 0 {
		return nil, errors.New("nothing to read: give --block-pool, --nfs-export-root and/or --state-dir")
	}
	r := &Report{}
	vols := map[string]*Volume{}
	records := map[string]*backend.Volume{}
	zones := make([]string, 0, len(o.BlockPools))
	for z := range o.BlockPools {
		zones = append(zones, z)
	}
	sort.Strings(zones)
	for _, z := range zones {
		readDir(r, filepath.Join(o.BlockPools[z], "volumes"), func(path string) {
			v := &backend.Volume{}
			if err := fsutil.ReadJSON(path, v); err != nil {
				r.Problems = append(r.Problems, err.Error())
				return
			}
			records[v.ID] = v
		})
	}
	if o.NFSExportRoot != "" {
		// The records live in the storage's root: the export root itself
		// (image storage) or the pool mounted in it (quota storage).
		for _, root := range []string{o.NFSExportRoot, filepath.Join(o.NFSExportRoot, "pool")} {
			readDir(r, filepath.Join(root, "meta", "volumes"), func(path string) {
				rec := struct {
					Volume backend.Volume `json:"volume"`
				}{}
				if err := fsutil.ReadJSON(path, &rec); err != nil {
					r.Problems = append(r.Problems, err.Error())
					return
				}
				records[rec.Volume.ID] = &rec.Volume
			})
		}
	}
	for id, rec := range records {
		if len(o.Volumes) > 0 && !contains(o.Volumes, id) {
			continue
		}
		vols[id] = fromRecord(rec, o.NFSExportConfigDir)
	}
	for _, dir := range o.StateDirs {
		readDir(r, filepath.Join(dir, nodestate.DirName), func(path string) {
			rec := &nodestate.Record{}
			if err := fsutil.ReadJSON(path, rec); err != nil {
				r.Problems = append(r.Problems, err.Error())
				return
			}
			if len(o.Volumes) > 0 && !contains(o.Volumes, rec.VolumeID) {
				return
			}
			v, ok := vols[rec.VolumeID]
			if !ok {
				// Held on a node, but no controller record was read.
				v = &Volume{ID: rec.VolumeID}
				if id, err := volumeid.Parse(rec.VolumeID); err == nil {
					v.Backend, v.Zone = string(id.Backend), id.Zone
				}
				vols[rec.VolumeID] = v
			}
			v.Holds = append(v.Holds, hold(rec, dir))
		})
	}
	for _, v := range vols {
		v.Verdicts = verdicts(v)
		r.Volumes = append(r.Volumes, *v)
	}
	sort.Slice(r.Volumes, func(i, j int) bool { return r.Volumes[i].ID < r.Volumes[j].ID })
	return r, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// readDir calls fn for every record file in dir; a missing dir is fine.
func readDir(r *Report, dir string, fn func(path string)) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	if err != nil {
		r.Problems = append(r.Problems, err.Error())
		return
	}
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".json") && !strings.HasPrefix(e.Name(), ".") {
			fn(filepath.Join(dir, e.Name()))
		}
	}
}

func fromRecord(rec *backend.Volume, exportDir string) *Volume {
	v := &Volume{
		ID: rec.ID, Name: rec.Name, Zone: rec.Zone, AccessType: string(rec.AccessType), FsType: rec.FsType,
		CapacityBytes: rec.CapacityBytes,
	}
	if id, err := volumeid.Parse(rec.ID); err == nil {
		v.Backend = string(id.Backend)
		if v.Backend == string(accessmode.BackendNFS) && exportDir != "" {
			v.ExportClients = exportClients(filepath.Join(exportDir, id.FileName()+".conf"))
		}
	}
	for _, m := range rec.Modes {
		v.Modes = append(v.Modes, accessmode.Name(m))
	}
	for _, a := range rec.Attachments {
		v.Attachments = append(v.Attachments, Attachment{Node: a.Node, Mode: accessmode.Name(a.Mode), ReadOnly: a.ReadOnly, Fenced: a.Fenced})
	}
	return v
}

func hold(rec *nodestate.Record, dir string) NodeHold {
	h := NodeHold{Node: rec.NodeID, StateDir: dir}
	if h.Node == "" {
		h.Node = "(node of " + dir + ")"
	}
	if st := rec.Staged; st != nil {
		h.StagingPath, h.Device, h.ReadOnly = st.StagingPath, st.Device, st.ReadOnly
	}
	for _, w := range rec.Holders {
		pod := ""
		if w.Workload.Name != "" {
			pod = strings.TrimPrefix(w.Workload.String(), "pod ")
		}
		h.Workloads = append(h.Workloads, Workload{TargetPath: w.TargetPath, Pod: pod,
			Mode: accessmode.Name(w.Mode), ReadOnly: w.ReadOnly, Since: w.Since})
	}
	return h
}

// exportClients reads the client list of an export file the driver
// rendered: one CLIENT block per client, Clients then Access_Type.
func exportClients(path string) []Client {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	clients := []Client{}
	var cur *Client
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSuffix(strings.TrimSpace(sc.Text()), ";")
		key, val, ok := strings.Cut(line, "=")
		key, val = strings.TrimSpace(key), strings.TrimSpace(val)
		switch {
		case strings.HasPrefix(line, "CLIENT"):
			clients = append(clients, Client{})
			cur = &clients[len(clients)-1]
		case cur != nil && ok && key == "Clients":
			cur.Address = val
		case cur != nil && ok && key == "Access_Type":
			cur.Access = val
		case line == "}":
			cur = nil
		}
	}
	return clients
}

// verdicts apply the access-mode rules to one more node and one more
// workload, so the report says what a new pod would run into.
func verdicts(v *Volume) []string {
	var out []string
	var atts []accessmode.Attachment
	for _, a := range v.Attachments {
		m, _ := accessmode.Parse(a.Mode)
		atts = append(atts, accessmode.Attachment{Node: a.Node, Mode: m, ReadOnly: a.ReadOnly})
	}
	if len(v.Modes) > 0 && len(atts) > 0 {
		m, _ := accessmode.Parse(v.Modes[0])
		// No node's key holds a blank: this is none of the attached.
		another := nodeid.Node{Name: "another node", Zone: atts[0].Node.Zone}
		rw := accessmode.CheckAttach(atts, accessmode.Attachment{Node: another, Mode: m})
		ro := accessmode.CheckAttach(atts, accessmode.Attachment{Node: another, Mode: m, ReadOnly: true})
		switch {
		case rw.Allowed():
			out = append(out, "another node may attach it read/write")
		case ro.Allowed():
			out = append(out, "another node may attach it read-only; read/write is refused: "+rw.Message)
		default:
			out = append(out, "another node is refused: "+rw.Message)
		}
	}
	if len(v.Attachments) == 0 {
		out = append(out, "not attached to any node: any node of its zone may attach it")
	}
	for _, h := range v.Holds {
		if len(h.Workloads) == 0 {
			continue
		}
		var hs []accessmode.Holder
		for _, w := range h.Workloads {
			m, _ := accessmode.Parse(w.Mode)
			hs = append(hs, accessmode.Holder{TargetPath: w.TargetPath, Mode: m, ReadOnly: w.ReadOnly,
				Fingerprint: "held", Workload: workloadOf(w.Pod)})
		}
		d := accessmode.CheckPublish(hs, accessmode.Holder{TargetPath: "(a new target path)", Mode: hs[0].Mode, Fingerprint: "new"})
		if d.Allowed() {
			out = append(out, fmt.Sprintf("on %s another workload may mount it too", h.Node))
		} else {
			out = append(out, fmt.Sprintf("on %s another workload is refused: %s", h.Node, d.Message))
		}
	}
	return out
}

func workloadOf(pod string) accessmode.Workload {
	ns, name, ok := strings.Cut(pod, "/")
	if !ok {
		return accessmode.Workload{Name: pod}
	}
	return accessmode.Workload{Namespace: ns, Name: name}
}

// WriteText prints the report for a person.
func (r *Report) WriteText(w io.Writer) {
	if len(r.Volumes) == 0 {
		fmt.Fprintln(w, "no volumes found")
	}
	for i, v := range r.Volumes {
		if i > 0 {
			fmt.Fprintln(w)
		}
		what := v.AccessType
		if v.FsType != "" {
			what += " " + v.FsType
		}
		fmt.Fprintf(w, "%s\n", v.ID)
		fmt.Fprintf(w, "  name %s, backend %s, zone %s, %s, %d bytes\n", orDash(v.Name), orDash(v.Backend), orDash(v.Zone), orDash(what), v.CapacityBytes)
		fmt.Fprintf(w, "  modes: %s\n", orDash(strings.Join(v.Modes, ", ")))
		if len(v.Attachments) == 0 {
			fmt.Fprintln(w, "  attached to: nobody")
		}
		for _, a := range v.Attachments {
			fenced := ""
			if a.Fenced {
				fenced = ", fenced: the storage serves it nothing until the fence is lifted"
			}
			fmt.Fprintf(w, "  attached to: %s (%s, %s%s)\n", a.Node, a.Mode, rwText(a.ReadOnly), fenced)
		}
		for _, h := range v.Holds {
			if h.StagingPath != "" {
				fmt.Fprintf(w, "  on %s: staged at %s (%s)\n", h.Node, h.StagingPath, rwText(h.ReadOnly))
			}
			for _, wl := range h.Workloads {
				fmt.Fprintf(w, "    held by %s at %s (%s, %s, since %s)\n", orDash(wl.Pod), wl.TargetPath, wl.Mode,
					rwText(wl.ReadOnly), wl.Since.Format(time.RFC3339))
			}
		}
		if v.ExportClients != nil {
			var cs []string
			for _, c := range v.ExportClients {
				cs = append(cs, c.Address+" "+c.Access)
			}
			fmt.Fprintf(w, "  export clients: %s\n", orDash(strings.Join(cs, ", ")))
		}
		for _, vd := range v.Verdicts {
			fmt.Fprintf(w, "  -> %s\n", vd)
		}
	}
	for _, p := range r.Problems {
		fmt.Fprintf(w, "problem: %s\n", p)
	}
}

func rwText(ro bool) string {
	if ro {
		return "read-only"
	}
	return "read/write"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
